"""What an input value may be: its grammar, bounds and types, vLLM's flags, and how a refusal is worded."""
