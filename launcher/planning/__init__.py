"""Planning actions: the gate every launch passes (validate + plan), action=recommend and its calibration."""
