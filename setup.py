"""Build npattn's one extension, npattn._core, and say where OpenBLAS comes from.

NPATTN_BLAS chooses the OpenBLAS:

  (unset) or "scipy"  the scipy-openblas32 wheel, a pinned build requirement.
                      Its symbols carry a `scipy_` prefix (csrc/blas.h maps the
                      names when NPATTN_BLAS_SCIPY is defined). The library is
                      copied beside the extension, into npattn/.libs, and found
                      through an RPATH ($ORIGIN/.libs; @loader_path/.libs on
                      macOS, where its install name is @rpath/...), as
                      auditwheel or delocate would vendor it, so nothing
                      imports scipy_openblas32 at run time.
  "system"            the system OpenBLAS (Debian: libopenblas-dev), found with
                      `pkg-config openblas`, else plain -lopenblas.

Everything else (metadata, dependencies, package data) is in pyproject.toml.
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BLAS_MODES = ("scipy", "system")
BLAS_MODE = os.environ.get("NPATTN_BLAS", "").strip().lower() or "scipy"
if BLAS_MODE not in BLAS_MODES:
    raise SystemExit(
        f"NPATTN_BLAS must be unset, 'scipy' (the scipy-openblas32 wheel) or "
        f"'system' (pkg-config openblas); got {os.environ['NPATTN_BLAS']!r}"
    )

# Where the scipy-openblas32 wheel's shared library is copied, inside the package:
# a folder that is no Python package, so that pkgutil and help() do not list it.
VENDORED_DIR = ".libs"


def core_sources():
    """The C core's sources and the glue's, as csrc/sources.mk lists them (for csrc/Makefile too)."""
    with open(os.path.join("csrc", "sources.mk")) as f:
        text = f.read().replace("\\\n", " ")
    names = []
    for var in ("CORE_SOURCES =", "GLUE_SOURCES ="):
        names += text.split(var, 1)[1].split("\n", 1)[0].split()
    return [os.path.join("csrc", name) for name in names]


def system_blas_flags():
    """Compile and link flags for the system OpenBLAS: pkg-config, else -lopenblas."""
    try:
        cflags = subprocess.run(
            ["pkg-config", "--cflags", "openblas"], check=True, capture_output=True, text=True
        ).stdout
        libs = subprocess.run(["pkg-config", "--libs", "openblas"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        print("npattn: pkg-config found no openblas; linking plain -lopenblas")
        return [], [], ["openblas"], []
    include_dirs, library_dirs, libraries, other = [], [], [], []
    for flag in shlex.split(cflags) + shlex.split(libs):
        for prefix, bucket in (("-I", include_dirs), ("-L", library_dirs), ("-l", libraries)):
            if flag.startswith(prefix):
                bucket.append(flag[len(prefix) :])
                break
        else:
            other.append(flag)
    return include_dirs, library_dirs, libraries, other


def compile_side_by_side(
    self,
    sources,
    output_dir=None,
    macros=None,
    include_dirs=None,
    debug=0,
    extra_preargs=None,
    extra_postargs=None,
    depends=None,
):
    """CCompiler.compile with the sources compiled side by side, one per CPU,
    the largest first (the kernel tables take most of the time)."""
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs
    )
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

    def compile_one(obj):
        src, ext = build[obj]
        self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

    largest_first = sorted(objects, key=lambda obj: -os.path.getsize(build[obj][0]))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, largest_first))  # list(): a failed compile raises here
    return objects


class BuildExt(build_ext):
    """build_ext that wires in the chosen OpenBLAS, compiles the sources side
    by side and vendors the wheel's library."""

    def finalize_options(self):
        super().finalize_options()
        # Object files from the other BLAS mode must never be reused: always rebuild.
        self.force = True

    def build_extension(self, ext):
        self.compiler.compile = types.MethodType(compile_side_by_side, self.compiler)
        super().build_extension(ext)

    def run(self):
        import numpy  # a build requirement; imported here so metadata needs no numpy

        ext = self.extensions[0]
        ext.include_dirs += [numpy.get_include(), "csrc"]
        if BLAS_MODE == "scipy":
            import scipy_openblas32 as wheel

            lib_dir = wheel.get_lib_dir()
            ext.include_dirs.append(wheel.get_include_dir())
            ext.library_dirs.append(lib_dir)
            ext.libraries.append(wheel.get_library())  # "scipy_openblas"
            ext.define_macros.append(("NPATTN_BLAS_SCIPY", "1"))
            origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
            ext.extra_link_args.append(f"-Wl,-rpath,{origin}/{VENDORED_DIR}")
            vendored = os.path.join(lib_dir, wheel.get_library(fullname=True))
        else:
            include_dirs, library_dirs, libraries, other = system_blas_flags()
            ext.include_dirs += include_dirs
            ext.library_dirs += library_dirs
            ext.libraries += libraries
            ext.extra_compile_args += [f for f in other if not f.startswith("-Wl,")]
            ext.extra_link_args += [f for f in other if f.startswith("-Wl,")]
            vendored = None

        super().run()  # in an editable/inplace build this also copies the extension

        # The library goes wherever the extension went: the build tree (wheels)
        # and, for editable/inplace builds, the source package. A system build
        # removes a copy left by an earlier default build.
        package_dirs = {os.path.join(self.build_lib, "npattn")}
        if self.inplace or getattr(self, "editable_mode", False):
            package_dirs.add(self.get_finalized_command("build_py").get_package_dir("npattn"))
        for package_dir in sorted(package_dirs):
            lib_dir = os.path.join(package_dir, VENDORED_DIR)
            if vendored:
                os.makedirs(lib_dir, exist_ok=True)
                target = os.path.join(lib_dir, os.path.basename(vendored))
                shutil.copyfile(vendored, target)
                print(f"npattn: vendored {vendored} -> {target}")
            elif os.path.isdir(lib_dir):
                shutil.rmtree(lib_dir)
                print(f"npattn: removed stale {lib_dir}")


core = Extension(
    "npattn._core",
    sources=core_sources(),
    depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/kernels/*.h") + ["csrc/sources.mk"]),
    define_macros=[
        # Build against NumPy 2.x headers, run on NumPy >= 1.24.
        ("NPY_NO_DEPRECATED_API", "NPY_1_24_API_VERSION"),
        ("NPY_TARGET_VERSION", "NPY_1_24_API_VERSION"),
    ],
    # Portable: no -march=native; SIMD paths are chosen at run time in the C code.
    extra_compile_args=["-O3", "-std=c11", "-fvisibility=hidden", "-Wall", "-Wextra"],
)

setup(ext_modules=[core], cmdclass={"build_ext": BuildExt})
