/* internal.h: what the core's files share and nobody else sees. */
#ifndef NPATTN_INTERNAL_H
#define NPATTN_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"

/* ---- pool.c: a persistent pool of threads that run the tasks of a job ---- */

/* The most threads one job runs on; asking for more runs on this many. */
#define NPATTN_POOL_MAX_THREADS 256

/* Runs task `task` of a job on the participant `slot` (0 .. n_threads-1);
 * a slot is held by one thread at a time, so it can index per-thread scratch. */
typedef void (*npattn_task_fn)(void *arg, int64_t task, int32_t slot);

/* Runs tasks 0 .. n_task-1, each once, on at most n_threads pool threads
 * (and at most NPATTN_POOL_MAX_THREADS), and
 * waits. While waiting, polls cancel(cancel_arg) about every 50 ms; when it
 * returns nonzero no new task starts and the call returns
 * NPATTN_STATUS_CANCELLED once the running ones end. Tasks are handed out in
 * index order, so put the longest first. */
enum npattn_status npattn_pool_run(npattn_task_fn fn, void *arg, int64_t n_task,
                                   int32_t n_threads, int (*cancel)(void *),
                                   void *cancel_arg);

/* ---- attention.c: checked allocation (with the test hook) ---- */

void *npattn_alloc(size_t n_bytes);  /* 64-byte aligned, NULL on failure */
void npattn_free(void *p);

#endif /* NPATTN_INTERNAL_H */
