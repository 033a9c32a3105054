"""Draft heads trained on self-distillation data (Medusa, MTPC, EAGLE): storage, loading and the training CLI."""
