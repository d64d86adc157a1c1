"""Where metrics go on rank 0: metrics.jsonl, TensorBoard, and the progress bar or log lines."""
