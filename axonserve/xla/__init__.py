"""The XLA worker backend (`--device xla`): worker ranks on a torch-xla device.

torch-neuronx is torch-xla plus the Neuron PJRT plugin, so this one backend runs on NeuronCores
(PJRT_DEVICE=NEURON), TPUs and, for development and CI, PJRT CPU. Modules: `device` (resolving the
device, the persistent compile cache, compile counters), `sampling` (sampling as tensor ops, per-row
parameters as tensors), `runner` (the bucketed, compiled-once-per-bucket model runner). torch-xla is
imported only here and only in worker processes; `pip install .` alone never needs it.
"""
