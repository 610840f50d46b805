/* pool.c: a persistent pool of worker threads shared by every call.
 *
 * A call posts a job (a task function and a task count) on a list; idle
 * workers join the jobs that have room (at most n_threads each) and claim
 * tasks with an atomic counter. The caller does not compute: it waits on the
 * job, waking every 50 ms to poll its cancel callback, which is how Ctrl-C
 * reaches a long call. Several calls from several threads share the workers.
 * Which worker runs a task never changes what the task computes, so results
 * do not depend on scheduling.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

#define POLL_NS 50000000L  /* the waiting caller polls cancel every 50 ms */

struct job {
    npattn_task_fn fn;
    void *arg;
    int64_t n_task;
    _Atomic int64_t next_task;   /* next task to claim */
    atomic_int stop;             /* set on cancel: claim nothing more */
    int32_t max_workers;         /* participants allowed */
    int32_t n_joined;            /* participants so far (slot numbers given) */
    int32_t n_active;            /* participants still running tasks */
    pthread_cond_t done;         /* signalled when the last participant leaves */
    struct job *next;            /* the pool's list of jobs with work left */
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work;         /* signalled when a job is posted */
    struct job *jobs;            /* jobs that may take more participants */
    int32_t n_workers;
    int32_t n_idle;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static int job_has_room(const struct job *j) {
    return j->n_joined < j->max_workers && !atomic_load(&j->stop) &&
           atomic_load(&j->next_task) < j->n_task;
}

static void unlink_job(struct job *j) {
    for (struct job **pp = &pool.jobs; *pp; pp = &(*pp)->next) {
        if (*pp == j) {
            *pp = j->next;
            return;
        }
    }
}

/* Called with the lock held; returns with it held. */
static void participate(struct job *j) {
    int32_t slot = j->n_joined++;
    j->n_active++;
    if (!job_has_room(j)) unlink_job(j);
    pthread_mutex_unlock(&pool.lock);
    for (;;) {
        if (atomic_load_explicit(&j->stop, memory_order_relaxed)) break;
        int64_t t = atomic_fetch_add(&j->next_task, 1);
        if (t >= j->n_task) break;
        j->fn(j->arg, t, slot);
    }
    pthread_mutex_lock(&pool.lock);
    unlink_job(j);  /* nothing left to claim */
    if (--j->n_active == 0) pthread_cond_broadcast(&j->done);
}

static void *worker_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        struct job *j = pool.jobs;
        while (j && !job_has_room(j)) j = j->next;
        if (!j) {
            pool.n_idle++;
            pthread_cond_wait(&pool.work, &pool.lock);
            pool.n_idle--;
            continue;
        }
        participate(j);
    }
    return NULL;
}

/* After fork() only the forking thread exists in the child: start afresh. */
static void atfork_prepare(void) { pthread_mutex_lock(&pool.lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&pool.lock); }
static void atfork_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pool.jobs = NULL;  /* a job of the parent's is not ours to finish */
    pool.n_workers = 0;
    pool.n_idle = 0;
}

static void pool_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* Starts workers until there are `want`; called with the lock held. */
static void grow(int32_t want) {
    if (want > NPATTN_POOL_MAX_THREADS) want = NPATTN_POOL_MAX_THREADS;
    while (pool.n_workers < want) {
        pthread_attr_t attr;
        pthread_t tid;
        if (pthread_attr_init(&attr) != 0) return;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);  /* kernels keep big data off the stack */
        int rc = pthread_create(&tid, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) return;  /* run with the workers we have */
        pool.n_workers++;
    }
}

enum npattn_status npattn_pool_run(npattn_task_fn fn, void *arg, int64_t n_task,
                                   int32_t n_threads, int (*cancel)(void *),
                                   void *cancel_arg) {
    if (n_task <= 0) return NPATTN_STATUS_OK;
    pthread_once(&pool_once, pool_init);

    struct job j;
    j.fn = fn;
    j.arg = arg;
    j.n_task = n_task;
    atomic_init(&j.next_task, 0);
    atomic_init(&j.stop, 0);
    j.max_workers = n_threads < 1 ? 1 : n_threads > NPATTN_POOL_MAX_THREADS ? NPATTN_POOL_MAX_THREADS : n_threads;
    if (j.max_workers > n_task) j.max_workers = (int32_t)n_task;
    j.n_joined = 0;
    j.n_active = 0;
    j.next = NULL;
    pthread_condattr_t cattr;
    if (pthread_condattr_init(&cattr) != 0) return NPATTN_STATUS_NO_MEMORY;
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(&j.done, &cattr);
    pthread_condattr_destroy(&cattr);
    if (rc != 0) return NPATTN_STATUS_NO_MEMORY;

    pthread_mutex_lock(&pool.lock);
    grow(j.max_workers);
    if (pool.n_workers == 0) {
        pthread_mutex_unlock(&pool.lock);
        pthread_cond_destroy(&j.done);
        return NPATTN_STATUS_NO_THREADS;
    }
    j.next = pool.jobs;
    pool.jobs = &j;
    pthread_cond_broadcast(&pool.work);

    enum npattn_status status = NPATTN_STATUS_OK;
    /* Done when nothing is left to claim and nobody is still running. */
    while (j.n_active > 0 || job_has_room(&j) ||
           (!atomic_load(&j.stop) && atomic_load(&j.next_task) < j.n_task)) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += POLL_NS;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec += 1;
            until.tv_nsec -= 1000000000L;
        }
        rc = pthread_cond_timedwait(&j.done, &pool.lock, &until);
        if (rc == ETIMEDOUT && cancel && !atomic_load(&j.stop)) {
            /* Poll without the lock: the callback may wait for Python's GIL. */
            pthread_mutex_unlock(&pool.lock);
            int stop = cancel(cancel_arg);
            pthread_mutex_lock(&pool.lock);
            if (stop) {
                atomic_store(&j.stop, 1);
                status = NPATTN_STATUS_CANCELLED;
            }
        }
    }
    unlink_job(&j);
    pthread_mutex_unlock(&pool.lock);
    pthread_cond_destroy(&j.done);
    return status;
}
