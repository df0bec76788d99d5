"""Building blocks shaped for tensor parallelism (column/row linears, norms, rotary)."""
