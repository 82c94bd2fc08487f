"""Layer-wise KV compression (PyramidKV / SnapKV): after a prompt, the upper layers keep only the tokens its
last queries attend to most (`extension.LayerwiseKV`, found by the engine's extension registry as
`layerwise`); the scores and per-layer budgets are `rayapp.kernels.snapkv`'s."""
