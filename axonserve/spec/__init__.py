"""Speculative decoding: the EAGLE draft head and its trainer."""
