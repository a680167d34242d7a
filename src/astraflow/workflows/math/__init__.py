"""The math workload: arithmetic and MATH-style problems with a boxed answer (`math`, `math-multi-agent`)."""
