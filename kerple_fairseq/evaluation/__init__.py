"""Length-extrapolation evaluation: token windows for each protocol, and their batched scoring."""
