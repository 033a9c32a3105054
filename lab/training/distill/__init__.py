"""Self-distillation data for draft heads: prompts, generation, loading."""
