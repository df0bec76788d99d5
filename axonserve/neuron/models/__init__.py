"""Model implementations (one module per architecture family)."""
