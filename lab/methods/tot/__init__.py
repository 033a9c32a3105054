"""Tree of Thoughts (Yao et al. 2023): tasks, model calls, search and evaluation."""
