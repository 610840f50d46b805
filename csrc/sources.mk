# The C core's sources: read by csrc/Makefile and by setup.py (which adds module.c).
CORE_SOURCES = core.c rules.c plan.c forward.c backward.c pool.c \
	kernels/dispatch.c kernels/convert.c kernels/portable.c \
	kernels/avx2.c kernels/avx512.c kernels/amx.c kernels/neon.c
