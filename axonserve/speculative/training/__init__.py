"""Offline training of EAGLE draft heads (`axonserve train-eagle`): prompts, self-distilled data,
the trainer and its acceptance evaluation. Never imported by the serving path."""
