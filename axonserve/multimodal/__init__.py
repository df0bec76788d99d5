"""Image inputs for vision-language models, every layer side by side.

- `frontend`: chat `image_url` parts -> pixels (URL fetches and decoding under size, time and
  address guards) and the prompt's placeholder runs (HTTP and offline frontends).
- `scheduler`: the scheduler's checks of a request's images (no torch).
- `router`: the encoder router actor, which spreads image jobs over the encoder pool and caches
  features by image hash.
- `encoder`: the encoder actor, one process of the pool running the vision tower and projector.
- `worker`: image features per request merged into the worker's batch (in-process encoding
  when there is no pool).

The model code (vision towers, LLaVA) stays with the models in `axonserve.neuron.models`.
"""
