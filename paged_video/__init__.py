"""paged_video: Triton kernels for paged, non-causal attention over the KV cache of autoregressive
video-diffusion models, the paging that feeds them, and their float64 oracles.

The repository keeps one folder per subpackage at its top (``kernels/``, ``paging/``,
``reference/``, ``models/``, ``bench/``); ``pyproject.toml`` installs them under this one
distinctive name, so they never collide with Hugging Face's ``kernels`` package (which vllm-omni
and diffusers import) or any other generic top-level name. Importing this root loads nothing
heavy: ``paged_video.paging`` alone never loads Triton.
"""

from pathlib import Path

__version__ = "0.2.0"

# Run from a clone without installing (``PYTHONPATH=<clone>``: the GPU image, where nothing can be
# installed, or a side venv with another Triton): the subpackages are the folders beside this one.
_clone = Path(__file__).resolve().parent.parent
if (_clone / "pyproject.toml").is_file() and (_clone / "kernels" / "__init__.py").is_file():
    __path__.append(str(_clone))
