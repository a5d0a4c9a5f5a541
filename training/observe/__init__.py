"""What a run shows while it trains: metrics rows (metrics.py), TensorBoard (tensorboard.py), Weights & Biases
(wandb_sink.py, optional) and the progress line (progress.py). The loop calls them as observers (observer.py: the
protocol and the step record); they never decide anything about the training itself."""
