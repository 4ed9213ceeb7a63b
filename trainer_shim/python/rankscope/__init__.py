"""rankscope: out-of-band monitoring of data-parallel training consistency.

``rankscope.torch`` is the PyTorch trainer shim (``rst.attach(ddp_model)``); ``rankscope.control``
sends operator control (what ``rankscope ctl`` sends) from Python. The native parts live in
``rankscope._native`` (pybind11 over the C++ agent and count sketch).
"""

from rankscope._native import AGENT_VERSION as __version__
from rankscope._native import DEFAULT_SKETCH_DIM, DEFAULT_SKETCH_SEED, MAX_SKETCH_DIM

__all__ = ["__version__", "DEFAULT_SKETCH_DIM", "DEFAULT_SKETCH_SEED", "MAX_SKETCH_DIM"]
