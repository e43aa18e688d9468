from setuptools import find_packages, setup

setup(
    name="attn_reg_plugin",
    version="0.1.0",
    description="AD-DROP and AttendOut attention-dropout regularizers for fairseq, transformers and PyTorch",
    packages=find_packages(include=["attn_reg_plugin", "attn_reg_plugin.*"]),
    python_requires=">=3.8",
    install_requires=["torch>=2.0"],
    extras_require={
        "fairseq": [
            "fairseq-fixed==0.12.3.1; python_version>='3.11'",
            "fairseq==0.12.2; python_version<'3.11'",
            "sacrebleu>=2.0",
            "sentencepiece",
        ],
        "hf": ["transformers>=5.0", "datasets", "sentencepiece", "sacrebleu>=2.0", "accelerate"],
        "test": ["pytest", "hypothesis"],
        "plots": ["matplotlib"],
    },
)
