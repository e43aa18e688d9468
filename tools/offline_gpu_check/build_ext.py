"""Build fairseq's two Cython helpers in place (batch_by_size, token blocks) against this numpy."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

mods = ["fairseq.data.data_utils_fast", "fairseq.data.token_block_utils_fast"]
exts = [Extension(m, [m.replace(".", "/") + ".pyx"], include_dirs=[numpy.get_include()], language="c++") for m in mods]
setup(
    name="fairseq-ext",
    ext_modules=cythonize(exts, language_level=3, quiet=True),
    script_args=["build_ext", "--inplace", "-q"],
)
