"""Adapters that put this project's kernels behind other engines' attention call sites.

``paged_video.integrations.vllm_omni`` routes vllm-omni's AR-Diffusion paged self-attention to
``paged_video.kernels``. Importing this package loads nothing heavy.
"""

if __name__ != "paged_video.integrations":  # a bare `import integrations` from a clone's root
    raise ImportError("this folder is paged_video.integrations; import it by that name")
