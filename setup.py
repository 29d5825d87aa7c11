"""Builds tf_nestpipe and its custom TensorFlow ops against the installed TensorFlow.

Bazel is not needed: the op library is compiled with g++ and the flags from
`tf.sysconfig` (C++17, the C++11 ABI TensorFlow was built with). The source list
below must match `BUILD` (tests/test_build_files.py checks it).
"""
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

OP_SOURCES = [
    "ops/dynamic_table_ops.cc",
    "ops/gather_ops.cc",
    "ops/init_ops.cc",
    "ops/pipeline_ops.cc",
    "ops/routing_ops.cc",
    "ops/socket_ops.cc",
    "ops/update_ops.cc",
    "ops/wire_ops.cc",
]

BIND_SHIM = "tf_nestpipe._nestpipe_bind"


def _tensorflow_flags():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


class BuildTensorFlowOps(build_ext):
    """Compiles the op library as a plain shared object named _nestpipe_ops.so."""

    def get_ext_filename(self, ext_name):
        return ext_name.replace(".", "/") + ".so"

    def build_extensions(self):
        compile_flags, link_flags = _tensorflow_flags()
        for ext in self.extensions:
            if ext.name == BIND_SHIM:  # plain C, no TensorFlow
                ext.extra_compile_args = ["-O2", "-fPIC"]
                continue
            ext.extra_compile_args = compile_flags + ["-O3", "-fPIC", "-Wno-deprecated-declarations"]
            ext.extra_link_args = link_flags
        for flag in ("-Wstrict-prototypes",):
            if flag in self.compiler.compiler_so:
                self.compiler.compiler_so.remove(flag)
        super().build_extensions()


setup(
    name="tf_nestpipe",
    version="0.1.0",
    description="NestPipe distribution strategy for TensorFlow recommendation models",
    packages=find_packages(include=["tf_nestpipe", "tf_nestpipe.*"]),
    # The placement planner's default collective costs (tf_nestpipe/plan/collective_costs.py).
    package_data={"tf_nestpipe.plan": ["default_costs.json"]},
    python_requires=">=3.9",
    install_requires=[
        "tensorflow==2.21.*",
        "tf-keras==2.21.*",
        "tensorflow-recommenders",
        "tensorboard",
        "numpy",
    ],
    extras_require={"test": ["pytest"]},
    ext_modules=[Extension("tf_nestpipe._nestpipe_ops", sources=OP_SOURCES, language="c++"),
                 # LD_PRELOAD library: servers listen only on their TF_CONFIG address.
                 Extension(BIND_SHIM, sources=["native/bind_tf_config.c"], libraries=["dl"])],
    cmdclass={"build_ext": BuildTensorFlowOps},
)
