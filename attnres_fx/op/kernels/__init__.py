"""Native kernels of the aggregation (:mod:`attnres_fx.op.ops` defines the operators they implement).

- :mod:`.cpu`: C++ (``cpu.cpp``), vectorised with ``at::vec``, parallel over tokens; built once per
  machine at first use into a cache directory, or the PyTorch formulation with one warning where no
  compiler or ninja is found.
- :mod:`.gpu`: Triton, for CUDA tensors (``pip install 'attnres-fx[triton]'``).
"""
