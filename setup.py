"""Build the one native piece: the CPU gather/scatter kernel of ncclkv.paged.

Everything else is declared in setup.cfg; setuptools cannot declare C extensions there.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ncclkv.paged._kernel",
            sources=["ncclkv/paged/_kernel.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ]
)
