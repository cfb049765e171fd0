"""Only the C extension lives here; everything else is in pyproject.toml.

The sampler extension is optional: without a C compiler the package still installs and
`edgeinfer.sampling.BACKEND` reports "numpy".
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "edgeinfer.sampling._csampler",
            sources=["edgeinfer/sampling/_csampler.c", "edgeinfer/sampling/sampler_chain.c",
                     "edgeinfer/sampling/sampler_kernels.c", "edgeinfer/sampling/sampler_penalties.c"],
            depends=["edgeinfer/sampling/sampler_chain.h"],
            extra_compile_args=["-O3", "-std=c99", "-fno-trapping-math", "-fno-math-errno"],
            optional=True,
        )
    ]
)
