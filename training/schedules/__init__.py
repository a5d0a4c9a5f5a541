"""Micro-batch schedules: the pipeline-parallel ones (gpipe, 1f1b, interleaved)."""
