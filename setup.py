from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description=("Megatron-style model-parallel GPT pretraining (TP, SP, CP, PP, DP/ZeRO) "
                 "that runs on CPU and GPU"),
    packages=find_packages(include=["megalite", "megalite.*"]),
    python_requires=">=3.9",
    # torch is never left open: from 2.13.0, which CI runs, to 2.15.0, the newest release, on
    # which the tests of the private torch APIs, torch.compile and several multi-process paths
    # were run (docs/quickstart.md lists them). Those APIs live in megalite/torch_private.py,
    # which warns outside this range. Before 2.5 SDPA lacks the enable_gqa the CP a2a path
    # passes. On Linux the default index's torch is the CUDA build (several GB); a CPU-only
    # machine installs torch first from https://download.pytorch.org/whl/cpu
    # (docs/quickstart.md).
    install_requires=[
        "torch>=2.13,<=2.15.0",
        "transformers>=4.40",
        "datasets>=2.18",
        "tokenizers>=0.15",
        "safetensors>=0.4",
        "wandb>=0.16",
        "numpy>=1.24",
        "tqdm",
    ],
    extras_require={
        # megatron-core is the oracle for the .bin/.idx byte layout (CPU-only use, no CUDA needed)
        "test": ["pytest>=7", "tensorboard>=2.10", "matplotlib>=3.5", "megatron-core==0.16.1"],
        "plot": ["matplotlib>=3.5"],
        "tensorboard": ["tensorboard>=2.10"],
        # fla's fused Gated DeltaNet kernel on CUDA, used after a self-check (docs/models.md)
        "fla": ["fla-core>=0.6"],
    },
)
