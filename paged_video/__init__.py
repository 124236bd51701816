"""paged_video: Triton kernels for paged, non-causal attention over the KV cache of autoregressive
video-diffusion models, the paging that feeds them, and their float64 oracles.

The repository keeps one folder per subpackage at its top (``kernels/``, ``paging/``,
``reference/``, ``models/``, ``bench/``, ``integrations/``); this folder links to each
(``paged_video/kernels -> ../kernels``), so ``paged_video.kernels`` is found by reading the tree,
from a clone (``PYTHONPATH=<clone>``), an editable install or the wheel (real files). The one
distinctive name keeps them from colliding with Hugging Face's ``kernels`` package (which
vllm-omni and diffusers import) or any other generic top-level name. Importing this root loads
nothing heavy: ``paged_video.paging`` alone never loads Triton.
"""

__version__ = "0.2.0"
