"""Length-extrapolation evaluation: token spans for each protocol, and their batched scoring."""
