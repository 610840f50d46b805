/* pool.c: the calling thread computes, helper threads join when asked.
 *
 * A call runs its tasks on its own thread. When the driver judges the work
 * big enough to repay waking others, the call also posts a job on the pool's
 * list; idle helpers join jobs that have room and claim tasks with an atomic
 * counter, as the caller does. Which thread runs a task never changes what
 * the task computes, so results do not depend on scheduling, and a call
 * whose helpers cannot start still completes on its own thread.
 *
 * Reliability:
 * - Ctrl-C: the calling thread polls the cancel callback about every 50 ms,
 *   between tiles and while it waits for helpers.
 * - Exit: an atexit hook stops every job and waits until no thread is inside
 *   a task, so no tile runs while the C library tears down OpenBLAS.
 * - fork: waits until no BLAS product runs (OpenBLAS's locks are not reset
 *   in a child); the child starts with an empty pool; a call in flight in
 *   the forking thread (from a signal handler that forked) recomputes, on
 *   its own, the tasks the parent's helpers had claimed.
 * - A host's OpenMP: in a process whose other library (PyTorch) runs on an
 *   OpenMP team, the glue may hand the pool that runtime's entry point
 *   (npattn_pool_use_openmp); a call's helpers are then that team's threads,
 *   asked for through GOMP_parallel, instead of the pool's own. Its threads
 *   spin for a while after each of the host's parallel regions, so helpers of
 *   the pool's own would share the cores with them right when a call starts;
 *   the team's threads are the ones awake, and no core has two.
 * - Memory: OpenBLAS keeps a table of work buffers, one per product running
 *   at once, maps a new one when every buffer it has is in use, and ends the
 *   process when that map fails. The tiles' products go through
 *   npattn_pool_sgemm / dgemm, which count those that reach OpenBLAS (a
 *   float product goes to the kernel table's gemm_f32 where it has one,
 *   which needs no buffer): one that would run beside
 *   more products than ever before first makes sure there is room for one
 *   more buffer, and without it fails the call (NPATTN_STATUS_NO_MEMORY)
 *   instead of reaching OpenBLAS.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "blas.h"
#include "internal.h"
#include "kernels/kernels.h"

#define POLL_NS 50000000LL      /* the calling thread polls cancel every 50 ms */
#ifndef NPATTN_SPIN_NS
#define NPATTN_SPIN_NS 100000LL /* an idle helper watches for work this long before it sleeps */
#endif
#define EXIT_WAIT_NS 5000000000LL /* the exit hook waits at most 5 s for tiles to stop */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* ---- one call's run state ---- */

static atomic_int exiting;  /* set by the exit hook: every tile stops */
static atomic_int n_inside; /* threads running tasks right now */

static _Atomic int64_t poll_ns = POLL_NS; /* npattn_debug_poll_interval */

void npattn_run_init(struct npattn_run *run, int (*cancel)(void *), void *cancel_arg) {
    atomic_init(&run->stop, 0);
    atomic_init(&run->status, NPATTN_STATUS_OK);
    run->cancel = cancel;
    run->cancel_arg = cancel_arg;
    run->next_poll_ns = cancel ? now_ns() + atomic_load_explicit(&poll_ns, memory_order_relaxed) : 0;
}

void npattn_run_fail(struct npattn_run *run, enum npattn_status status) {
    int ok = NPATTN_STATUS_OK;
    atomic_compare_exchange_strong(&run->status, &ok, (int)status);
    atomic_store(&run->stop, 1);
}

static int poll_cancel(struct npattn_run *run) {
    if (!run->cancel) return 0;
    int64_t now = now_ns();
    if (now < run->next_poll_ns) return 0;
    int stop = run->cancel(run->cancel_arg);
    run->next_poll_ns = now_ns() + atomic_load_explicit(&poll_ns, memory_order_relaxed);
    if (stop) npattn_run_fail(run, NPATTN_STATUS_CANCELLED);
    return stop;
}

int npattn_run_stopped(struct npattn_run *run, int32_t slot) {
    if (atomic_load_explicit(&run->stop, memory_order_relaxed)) return 1;
    if (atomic_load_explicit(&exiting, memory_order_relaxed)) {
        npattn_run_fail(run, NPATTN_STATUS_CANCELLED);
        return 1;
    }
    return slot == 0 && poll_cancel(run);
}

/* ---- the pool ---- */

struct job {
    npattn_task_fn fn;
    void *arg;
    int64_t n_task;
    struct npattn_run *run;
    int32_t max_helpers;       /* helpers allowed to join */
    int is_open;               /* posted as the pool's open job (else on its list) */
    int orphaned;              /* in a forked child: the helpers that had joined are gone */
    pthread_t caller;          /* the thread that runs the call */
    struct job *next;          /* the pool's list of other jobs that take helpers */
    struct job *next_call;     /* the list of every call in flight */
    /* what every helper changes, each on a cache line of its own */
    _Alignas(64) _Atomic int64_t next_task; /* next task to claim */
    _Alignas(64) atomic_int n_joined;       /* seats taken (slot numbers given), and tries past max_helpers */
    _Alignas(64) atomic_int n_active;       /* helpers that joined and have not left */
};

/* A call's helpers join it without the lock: the call posts its job as the
 * pool's open job, which a helper takes a seat in with one atomic step, and
 * before the call returns it closes the job and waits until no helper is
 * still looking at it. Jobs posted while another is open (calls from other
 * threads) wait on a list, which helpers read under the lock. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t work;          /* a job was posted */
    pthread_cond_t done;          /* a job's last helper left */
    struct job *jobs;             /* the list: other jobs that may take more helpers */
    struct job *calls;            /* every call in flight, helpers or not */
    int32_t n_workers;            /* helper threads started */
    int32_t n_sleeping;           /* helpers waiting on `work` */
    /* read by every helper, changed once or twice a call */
    _Alignas(64) atomic_int posted; /* counts posted jobs: what a spinning helper watches */
    _Atomic(struct job *) open;   /* the job helpers join without the lock, or NULL */
    atomic_int n_listed;          /* jobs on the list */
    atomic_int callers_asleep;    /* callers waiting on `done` */
    /* changed by every helper */
    _Alignas(64) atomic_int peeking; /* helpers looking at `open` right now */
    _Alignas(64) atomic_int n_watching; /* helpers spinning on `posted`: a post wakes sleepers only past them */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static atomic_int pool_mode;                  /* the test hook */
static atomic_int max_default_threads;        /* npattn_set_num_threads; 0: no cap */

void npattn_debug_pool_mode(int mode) { atomic_store(&pool_mode, mode); }
void npattn_debug_poll_interval(int64_t ns) { atomic_store(&poll_ns, ns > 0 ? ns : POLL_NS); }
int npattn_pool_mode(void) { return atomic_load(&pool_mode); }

static int cpus_available(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)(n < NPATTN_POOL_MAX_THREADS ? n : NPATTN_POOL_MAX_THREADS) : 1;
}

int npattn_get_num_threads(void) {
    int n = cpus_available(), cap = atomic_load(&max_default_threads);
    return cap > 0 && cap < n ? cap : n;
}

void npattn_set_num_threads(int n) { atomic_store(&max_default_threads, n > 0 ? n : 0); }

int32_t npattn_env_threads(void) {
    const char *env = getenv("NPATTN_NUM_THREADS");
    if (!env) return 0;
    char *end;
    errno = 0;
    const long long v = strtoll(env, &end, 10); /* leading spaces skipped */
    while (end != env && (*end == ' ' || *end == '\t' || *end == '\n')) end++;
    return end == env || *end != '\0' || errno || v < 1 || v > NPATTN_MAX_THREADS ? -1 : (int32_t)v;
}

int32_t npattn_pool_threads(int32_t n_threads) {
    const int32_t env = n_threads >= 1 ? 0 : npattn_env_threads();
    int32_t n = n_threads >= 1 ? n_threads : env > 0 ? env : (int32_t)npattn_get_num_threads();
    return n > NPATTN_POOL_MAX_THREADS ? NPATTN_POOL_MAX_THREADS : n;
}

/* Counts this thread in; 0 if the process is exiting and it must not start. */
static int enter(void) {
    atomic_fetch_add(&n_inside, 1);
    if (atomic_load(&exiting)) {
        atomic_fetch_sub(&n_inside, 1);
        return 0;
    }
    return 1;
}

static void leave(void) { atomic_fetch_sub(&n_inside, 1); }

/* The call in flight whose caller is this thread, or NULL; the lock held. */
static struct job *own_call(void) {
    for (struct job *j = pool.calls; j; j = j->next_call)
        if (pthread_equal(j->caller, pthread_self())) return j;
    return NULL;
}

static void unlink_call(struct job *j) {
    for (struct job **pp = &pool.calls; *pp; pp = &(*pp)->next_call)
        if (*pp == j) {
            *pp = j->next_call;
            return;
        }
}

/* ---- OpenBLAS's work buffers ---- */

/* Room for one buffer: OpenBLAS's BUFFER_SIZE is 32 MiB (a build may raise
 * it with BUFFERSIZE; the first product of this process maps 32 MiB on
 * x86-64), mapped with a page of slack; twice that, to leave some margin. */
#define BLAS_BUFFER_ROOM ((size_t)64 << 20)

static atomic_int n_products;      /* products running now */
static atomic_int most_products;   /* the most that have run at once: OpenBLAS has that many buffers */
static pthread_mutex_t room_lock = PTHREAD_MUTEX_INITIALIZER;

/* fork() waits at this gate until no product runs: OpenBLAS's buffer table
 * has a lock of its own, and a child forked while another thread held it
 * would wait for it forever in its first product. */
static atomic_int forking;
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_open = PTHREAD_COND_INITIALIZER;
#define FORK_WAIT_NS 2000000000LL /* at most 2 s: a fork from a signal handler inside a product */

/* Counts a product in, once no fork is waiting. */
static int product_count_in(void) {
    for (;;) {
        int n = atomic_fetch_add(&n_products, 1) + 1;
        if (!atomic_load(&forking)) return n;
        atomic_fetch_sub(&n_products, 1);
        pthread_mutex_lock(&gate_lock);
        while (atomic_load(&forking)) pthread_cond_wait(&gate_open, &gate_lock);
        pthread_mutex_unlock(&gate_lock);
    }
}

/* Counts a product in; 0 (and the run failed) when it would need a buffer
 * OpenBLAS could not map. Mapped and unmapped to see; what remains is the
 * chance that another thread takes the room in the moment between. */
static int product_begin(struct npattn_run *run) {
    int n = product_count_in(), ok = 1;
    if (n <= atomic_load(&most_products)) return 1;
    pthread_mutex_lock(&room_lock);
    if (n > atomic_load(&most_products)) {
        /* as OpenBLAS maps it (so that a commit limit counts it too), never touched */
        void *at = mmap(NULL, BLAS_BUFFER_ROOM, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ok = at != MAP_FAILED;
        if (ok) {
            munmap(at, BLAS_BUFFER_ROOM);
            atomic_store(&most_products, n);
        }
    }
    pthread_mutex_unlock(&room_lock);
    if (!ok) {
        atomic_fetch_sub(&n_products, 1);
        npattn_run_fail(run, NPATTN_STATUS_NO_MEMORY);
    }
    return ok;
}

/* A product skipped for want of memory leaves C as it was; the run has
 * failed, so nothing computed from it is kept. */
void npattn_pool_sgemm(struct npattn_run *run, enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb,
                       int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                       float *C, int ldc) {
    const struct npattn_kernels *kn = npattn_kernels();
    if (kn->gemm_f32 && order == CblasRowMajor && tb == CblasNoTrans) { /* the kernel table's own */
        const int64_t a_rs = ta == CblasNoTrans ? lda : 1, a_ps = ta == CblasNoTrans ? 1 : lda;
        kn->gemm_f32(M, N, K, alpha, A, a_rs, a_ps, B, ldb, beta, C, ldc);
        return;
    }
    if (!product_begin(run)) return;
    npattn_cblas_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    atomic_fetch_sub(&n_products, 1);
}

void npattn_pool_dgemm(struct npattn_run *run, enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb,
                       int M, int N, int K, double alpha, const double *A, int lda, const double *B, int ldb,
                       double beta, double *C, int ldc) {
    if (!product_begin(run)) return;
    npattn_cblas_dgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    atomic_fetch_sub(&n_products, 1);
}

static void run_tasks(struct job *j, int32_t slot) {
    for (;;) {
        if (atomic_load_explicit(&j->run->stop, memory_order_relaxed)) break;
        int64_t t = atomic_fetch_add(&j->next_task, 1);
        if (t >= j->n_task) break;
        j->fn(j->arg, t, slot);
    }
}

/* A seat in j for a helper: its slot; 0 when j is stopped or has no task
 * left to claim; -1 when its seats are taken. A helper that passes the checks
 * just as the last task is claimed joins to find nothing, which costs a
 * moment and nothing else. */
static int32_t take_seat(struct job *j) {
    if (atomic_load(&j->run->stop) || atomic_load(&j->next_task) >= j->n_task) return 0;
    if (atomic_load(&j->n_joined) >= j->max_helpers) return -1;
    int32_t n = atomic_fetch_add(&j->n_joined, 1); /* past max_helpers by at most the helpers there are */
    if (n >= j->max_helpers) return -1;
    atomic_fetch_add(&j->n_active, 1); /* before the helper stops peeking or unlocks */
    return 1 + n;
}

/* Takes j off the list, the lock held. */
static void unlink_job(struct job *j) {
    for (struct job **pp = &pool.jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            atomic_fetch_sub(&pool.n_listed, 1);
            return;
        }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Takes the pool's lock. Threads hold it for a few instructions, and
 * several may reach for it within moments (helpers of listed jobs, helpers
 * going to sleep, callers): one that found it taken and slept in the kernel
 * would wake microseconds later, so it first retries a while. */
#define LOCK_SPINS 2000
static void lock_pool(void) {
    for (int i = 0; i < LOCK_SPINS; i++) {
        if (pthread_mutex_trylock(&pool.lock) == 0) return;
        cpu_relax();
    }
    pthread_mutex_lock(&pool.lock);
}

/* A job with room for this helper, and its slot there: the open job, else
 * one on the list; NULL if none, and *full set when the one it tried last
 * had all the helpers it wanted. */
static struct job *find_job(int32_t *slot, int *full) {
    atomic_fetch_add(&pool.peeking, 1);
    struct job *j = atomic_load(&pool.open);
    *slot = j ? take_seat(j) : 0;
    atomic_fetch_sub(&pool.peeking, 1);
    *full = *slot < 0;
    if (*slot > 0) return j;
    if (atomic_load(&pool.n_listed) == 0) return NULL;
    lock_pool();
    for (j = pool.jobs; j; j = j->next) {
        *slot = take_seat(j);
        *full = *slot < 0;
        if (*slot > 0) break;
    }
    pthread_mutex_unlock(&pool.lock);
    return j;
}

/* Waits for a job posted after `seen`: first watching for a short while, so
 * that back-to-back calls (a decode loop) find their helpers awake, then
 * asleep on the condition variable. A helper that found the last job full
 * sleeps at once: a call that wants few helpers on a machine of many then
 * has no crowd spinning beside it, and a post wakes sleepers only past the
 * helpers watching. */
static void wait_for_work(int seen, int watch) {
    if (watch) {
        atomic_fetch_add(&pool.n_watching, 1);
        int64_t until = now_ns() + NPATTN_SPIN_NS;
        int spins = 0;
        while (atomic_load_explicit(&pool.posted, memory_order_relaxed) == seen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() > until) break;
        }
        atomic_fetch_sub(&pool.n_watching, 1);
    }
    lock_pool();
    if (atomic_load(&pool.posted) == seen) {
        pool.n_sleeping++;
        pthread_cond_wait(&pool.work, &pool.lock);
        pool.n_sleeping--;
    }
    pthread_mutex_unlock(&pool.lock);
}

static void *worker_main(void *unused) {
    (void)unused;
    for (;;) {
        int seen = atomic_load(&pool.posted), full;
        int32_t slot;
        struct job *j = find_job(&slot, &full);
        if (!j) {
            wait_for_work(seen, !full);
            continue;
        }
        if (enter()) {
            run_tasks(j, slot);
            leave();
        }
        /* j may be gone once n_active is 0; a caller that sleeps counts
         * itself in callers_asleep before it looks at n_active */
        if (atomic_fetch_sub(&j->n_active, 1) == 1 && atomic_load(&pool.callers_asleep) > 0) {
            lock_pool();
            pthread_cond_broadcast(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    return NULL;
}

/* Stops every call and waits (boundedly) until no tile runs but, should it be
 * called from inside a call, this thread's own. Also the exit hook. */
void npattn_shutdown(void) {
    atomic_store(&exiting, 1);
    lock_pool();
    int mine = own_call() != NULL;
    pthread_mutex_unlock(&pool.lock);
    int64_t until = now_ns() + EXIT_WAIT_NS;
    while (atomic_load(&n_inside) > mine && now_ns() < until) {
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

/* fork(): only the forking thread exists in the child. Start afresh; a job
 * this thread is the caller of loses its helpers. */
static void atfork_prepare(void) {
    pthread_mutex_lock(&gate_lock);
    atomic_store(&forking, 1);
    int64_t until = now_ns() + FORK_WAIT_NS;
    while (atomic_load(&n_products) > 0 && now_ns() < until) {
        struct timespec us = {0, 20000};
        nanosleep(&us, NULL);
    }
    lock_pool();
}

static void open_gate(void) {
    atomic_store(&forking, 0);
    pthread_cond_broadcast(&gate_open);
    pthread_mutex_unlock(&gate_lock);
}

static void atfork_parent(void) {
    pthread_mutex_unlock(&pool.lock);
    open_gate();
}

static void atfork_child(void) {
    struct job *mine = own_call(); /* the lock is ours: atfork_prepare took it */
    pthread_mutex_init(&gate_lock, NULL);
    pthread_cond_init(&gate_open, NULL);
    pthread_mutex_init(&room_lock, NULL);
    atomic_store(&forking, 0);
    atomic_store(&n_products, 0);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    atomic_store(&pool.open, NULL);
    atomic_store(&pool.peeking, 0);
    pool.jobs = NULL;
    atomic_store(&pool.n_listed, 0);
    atomic_store(&pool.callers_asleep, 0);
    pool.calls = mine;
    pool.n_workers = 0;
    pool.n_sleeping = 0;
    atomic_store(&n_inside, mine ? 1 : 0);
    if (mine) {
        mine->next_call = NULL;
        mine->orphaned = 1;
        mine->n_active = 0;
    }
}

static void pool_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    atexit(npattn_shutdown);
}

/* Starts helpers until there are `want`; called with the lock held. */
static void grow(int32_t want) {
    if (npattn_pool_mode() == 1) return; /* the test hook: as if no thread could start */
    while (pool.n_workers < want) {
        pthread_attr_t attr;
        pthread_t tid;
        if (pthread_attr_init(&attr) != 0) return;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 4 << 20);
        int rc = pthread_create(&tid, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) return; /* run with the helpers there are */
        pool.n_workers++;
    }
}

/* An absolute CLOCK_REALTIME time 50 ms from now, for pthread_cond_timedwait. */
static struct timespec poll_deadline(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_nsec += POLL_NS;
    while (t.tv_nsec >= 1000000000L) {
        t.tv_sec += 1;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

/* ---- a host's OpenMP team as the helpers ---- */

static struct {
    _Atomic(npattn_omp_parallel_fn) parallel;
    _Atomic(npattn_omp_thread_num_fn) thread_num;
} host_omp;

static _Thread_local int openmp_here; /* this thread's calls run on the host's team */

void npattn_pool_use_openmp(npattn_omp_parallel_fn parallel, npattn_omp_thread_num_fn thread_num) {
    int on = parallel && thread_num;
    atomic_store(&host_omp.thread_num, on ? thread_num : NULL);
    atomic_store(&host_omp.parallel, on ? parallel : NULL);
}

int npattn_pool_openmp_here(int on) {
    int was = openmp_here;
    openmp_here = on != 0;
    return was;
}

/* What every member of the team runs: tasks, claimed as the pool's helpers
 * claim them. The caller (member 0) then stays until no member holds a task,
 * polling cancel as it waits, before the team's closing barrier. */
static void omp_member(void *data) {
    struct job *j = data;
    int32_t slot = (int32_t)atomic_load(&host_omp.thread_num)();
    if (slot > 0) {
        atomic_fetch_add(&j->n_active, 1); /* before any claim: the caller waits for it */
        if (enter()) {
            run_tasks(j, slot);
            leave();
        }
        atomic_fetch_sub(&j->n_active, 1);
        return;
    }
    run_tasks(j, 0);
    /* every task is claimed now; one a member claimed counted it active first */
    int64_t next_poll = now_ns() + POLL_NS;
    for (int spins = 1; atomic_load(&j->n_active) > 0; spins++) {
        cpu_relax();
        if (spins % 256 == 0 && now_ns() > next_poll) {
            npattn_run_stopped(j->run, 0); /* polls cancel: the members' next claim then stops */
            next_poll = now_ns() + POLL_NS;
        }
    }
}

/* Runs j on the host's team of 1 + helpers threads. */
static void run_on_openmp(struct job *j, npattn_omp_parallel_fn parallel, int32_t helpers) {
    atomic_init(&j->n_active, 0);
    parallel(omp_member, j, (unsigned)(1 + helpers), 0);
}

enum npattn_status npattn_pool_run(npattn_task_fn fn, void *arg, int64_t n_task, int32_t n_threads,
                                   struct npattn_run *run) {
    if (n_task <= 0) return (enum npattn_status)atomic_load(&run->status);
    pthread_once(&pool_once, pool_init);
    if (!enter()) {
        npattn_run_fail(run, NPATTN_STATUS_CANCELLED);
        return NPATTN_STATUS_CANCELLED;
    }
    struct job j = {.fn = fn, .arg = arg, .n_task = n_task, .run = run, .caller = pthread_self()};
    atomic_init(&j.next_task, 0);
    int32_t helpers = n_threads > NPATTN_POOL_MAX_THREADS ? NPATTN_POOL_MAX_THREADS - 1 : n_threads - 1;
    if (helpers > n_task - 1) helpers = (int32_t)(n_task - 1);
    npattn_omp_parallel_fn parallel = openmp_here ? atomic_load(&host_omp.parallel) : NULL;
    if (helpers > 0 && parallel && npattn_pool_mode() != 1) {
        run_on_openmp(&j, parallel, helpers);
        leave();
        return (enum npattn_status)atomic_load(&run->status);
    }

    /* every call is listed, so that a fork from inside it finds it (a few ns) */
    lock_pool();
    j.next_call = pool.calls;
    pool.calls = &j;
    if (helpers > 0) {
        grow(helpers);
        j.max_helpers = helpers < pool.n_workers ? helpers : pool.n_workers;
    }
    if (j.max_helpers > 0) {
        struct job *none = NULL;
        j.is_open = atomic_compare_exchange_strong(&pool.open, &none, &j);
        if (!j.is_open) {
            j.next = pool.jobs;
            pool.jobs = &j;
            atomic_fetch_add(&pool.n_listed, 1);
        }
        atomic_fetch_add(&pool.posted, 1);
        /* watching helpers see the post; sleepers are woken for the rest
         * (one that stops watching meanwhile finds the post under the lock) */
        const int32_t wake = j.max_helpers - atomic_load(&pool.n_watching);
        for (int32_t i = 0; i < wake && i < pool.n_sleeping; i++) pthread_cond_signal(&pool.work);
    }
    pthread_mutex_unlock(&pool.lock);

    run_tasks(&j, 0);

    if (j.max_helpers > 0) {
        /* closed: no helper finds j any more, nor still holds it without a seat */
        if (j.is_open) {
            struct job *me = &j;
            atomic_compare_exchange_strong(&pool.open, &me, NULL); /* fails only in a forked child */
            /* a peek is a few instructions, unless the helper lost its CPU in it */
            for (int spins = 1; atomic_load(&pool.peeking) > 0; spins++) {
                if (spins % 256) cpu_relax();
                else sched_yield();
            }
        } else {
            lock_pool();
            unlink_job(&j);
            pthread_mutex_unlock(&pool.lock);
        }
        /* the helpers mostly finish moments after the caller: watch for that
         * a short while before sleeping (a wake-up costs more than a small call) */
        int64_t until = now_ns() + NPATTN_SPIN_NS;
        for (int spins = 1; atomic_load(&j.n_active) > 0; spins++) {
            cpu_relax();
            if (spins % 256 == 0 && now_ns() > until) break;
        }
    }
    lock_pool();
    if (j.max_helpers > 0) {
        atomic_fetch_add(&pool.callers_asleep, 1); /* before n_active is read: see worker_main */
        while (atomic_load(&j.n_active) > 0 && !j.orphaned) {
            struct timespec until = poll_deadline();
            int rc = pthread_cond_timedwait(&pool.done, &pool.lock, &until);
            if (rc == ETIMEDOUT && !atomic_load(&run->stop)) {
                /* poll without the lock: the callback may wait for Python's GIL (or fork) */
                pthread_mutex_unlock(&pool.lock);
                if (atomic_load(&exiting)) npattn_run_fail(run, NPATTN_STATUS_CANCELLED);
                else if (run->cancel && run->cancel(run->cancel_arg)) npattn_run_fail(run, NPATTN_STATUS_CANCELLED);
                lock_pool();
            }
        }
        atomic_fetch_sub(&pool.callers_asleep, 1);
    }
    if (j.orphaned) { /* a forked child: the tasks the parent's helpers had are ours now */
        pthread_mutex_unlock(&pool.lock);
        for (int64_t t = 0; t < n_task && !atomic_load(&run->stop); t++) fn(arg, t, 0);
        lock_pool();
    }
    unlink_call(&j);
    pthread_mutex_unlock(&pool.lock);
    leave();
    return (enum npattn_status)atomic_load(&run->status);
}
