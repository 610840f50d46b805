# The C core's sources, read by csrc/Makefile, setup.py and .ci/run; and the CPython
# glue's, which setup.py adds for the extension (the core's tests do without it).
CORE_SOURCES = core.c rules.c plan.c forward.c backward.c pool.c \
	kernels/dispatch.c kernels/convert.c kernels/portable.c \
	kernels/avx2.c kernels/avx512.c kernels/amx.c kernels/neon.c
GLUE_SOURCES = module.c module_args.c module_errors.c
