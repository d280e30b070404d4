"""Research tools (quality sweeps); not part of the installed package."""
