// LD_PRELOAD shim for tests: every thread created with SIGINT blocked (the futex_waitv park backend's helper is
// created with every signal blocked) starts HOTLOOP_TEST_THREAD_START_DELAY_MS milliseconds late, and writes
// "thread-started <CLOCK_MONOTONIC seconds>" to stderr when it does. It holds a park's start-up open long enough
// for a test to signal the waiter inside it. Other threads start as usual.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct start {
  void* (*fn)(void*);
  void* arg;
};

static void* delayed_start(void* p) {
  struct start s = *(struct start*)p;
  free(p);
  const char* env = getenv("HOTLOOP_TEST_THREAD_START_DELAY_MS");
  long ms = env ? atol(env) : 0;
  struct timespec d = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&d, &d) != 0) {
  }
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  char line[64];
  int n = snprintf(line, sizeof line, "thread-started %ld.%09ld\n", (long)now.tv_sec, now.tv_nsec);
  if (write(2, line, (size_t)n) < 0) {
  }
  return s.fn(s.arg);
}

int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*fn)(void*), void* arg) {
  static int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  if (real == NULL) real = (int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*))dlsym(RTLD_NEXT, "pthread_create");
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, NULL, &mask);
  if (!sigismember(&mask, SIGINT)) return real(thread, attr, fn, arg);
  struct start* s = malloc(sizeof *s);
  if (s == NULL) return real(thread, attr, fn, arg);
  s->fn = fn;
  s->arg = arg;
  int rc = real(thread, attr, delayed_start, s);
  if (rc != 0) free(s);
  return rc;
}
