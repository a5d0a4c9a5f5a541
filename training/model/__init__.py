"""The model: the GPT decoder with explicit tensor/sequence parallelism, its initialisation, per-layer compile."""
