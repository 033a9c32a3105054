"""The engine: models and their loading, the forward paths (plain, row-invariant, lean, native C++), caches and the
runtime calls every decode loop makes, quantisation, sampling, tree attention and the one autoregressive loop.

The engine imports nothing from the packages above it (speculative, methods, heads, training, app, tools); only
the contract modules `lab.params` and `lab.trace` (docs/architecture.md, "Layout")."""
