"""Method internals that are more than a thin strategy: Mirostat's samplers, Tree of Thoughts' search and tasks, the
Recursive Language Model's loop and sandbox. Strategies in `strategies/` wire these to the engine."""
