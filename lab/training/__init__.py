"""Making draft heads: self-distillation data (`distill`) and the trainers of the Medusa, MTPC, EAGLE-1 and EAGLE-3
heads (`python -m lab train-heads`). Inference code for the heads lives in `lab.heads`."""
