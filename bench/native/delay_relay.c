/* Benchmark-only TCP relay that adds a fixed one-way delay (bench/delay_relay.py builds and runs
 * it; see there for the command line). Every chunk read from either side of a connection is
 * written to the other side `delay` after it arrived, in order; throughput is not limited by the
 * delay (reading goes on while earlier chunks wait).
 *
 * Native because the relay shares the benchmark's cores with the tasks: every byte the tasks
 * exchange crosses it twice, and the asyncio relay it replaces spent Python time on each 64 KiB
 * chunk, CPU the tasks' compute then lacked (an artifact a real network does not have).
 *
 * Per connection: two directions, each a reader thread (blocking read() into chunks stamped
 * with their due time, appended to a queue) and a writer thread (waits until the head chunk is
 * due, writes it whole). EOF is passed on as a half-close (shutdown(SHUT_WR)); an error on
 * either side shuts both sockets down so the other direction ends too. The last of the four
 * threads closes the sockets.
 *
 *   delay_relay --delay-ms D [--dynamic PORT] [LISTEN_PORT:HOST:PORT ...]
 *
 * With --dynamic PORT, connections to PORT first send a 6-byte header (IPv4 address and port,
 * network byte order) naming their destination (bench/native/relay_connect.c). Prints READY once
 * every port listens.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (1 << 18)

static struct timespec g_delay;

struct chunk {
  struct chunk *next;
  struct timespec due;
  size_t size; /* 0: end of stream */
  char data[];
};

struct connection {
  int fds[2]; /* client, server */
  pthread_mutex_t lock;
  int threads_left;
};

struct direction {
  struct connection *conn;
  int from, to;
  pthread_mutex_t lock;
  pthread_cond_t ready;
  struct chunk *head, *tail;
  int threads_left;
};

static void fail(const char *what) {
  perror(what);
  exit(1);
}

static void add_delay(struct timespec *t) {
  t->tv_sec += g_delay.tv_sec;
  t->tv_nsec += g_delay.tv_nsec;
  if (t->tv_nsec >= 1000000000L) {
    t->tv_sec += 1;
    t->tv_nsec -= 1000000000L;
  }
}

static void no_delay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* One of the connection's four threads is done; the last closes both sockets. */
static void release_connection(struct connection *conn) {
  pthread_mutex_lock(&conn->lock);
  int left = --conn->threads_left;
  pthread_mutex_unlock(&conn->lock);
  if (left == 0) {
    close(conn->fds[0]);
    close(conn->fds[1]);
    pthread_mutex_destroy(&conn->lock);
    free(conn);
  }
}

static void release_direction(struct direction *dir) {
  pthread_mutex_lock(&dir->lock);
  int left = --dir->threads_left;
  pthread_mutex_unlock(&dir->lock);
  if (left == 0) {
    pthread_mutex_destroy(&dir->lock);
    pthread_cond_destroy(&dir->ready);
    free(dir);
  }
}

static void push(struct direction *dir, struct chunk *c) {
  c->next = NULL;
  pthread_mutex_lock(&dir->lock);
  if (dir->tail)
    dir->tail->next = c;
  else
    dir->head = c;
  dir->tail = c;
  pthread_cond_signal(&dir->ready);
  pthread_mutex_unlock(&dir->lock);
}

static struct chunk *pop(struct direction *dir) {
  pthread_mutex_lock(&dir->lock);
  while (!dir->head) pthread_cond_wait(&dir->ready, &dir->lock);
  struct chunk *c = dir->head;
  dir->head = c->next;
  if (!dir->head) dir->tail = NULL;
  pthread_mutex_unlock(&dir->lock);
  return c;
}

static void *read_side(void *arg) {
  struct direction *dir = arg;
  for (;;) {
    struct chunk *c = malloc(sizeof(struct chunk) + CHUNK);
    if (!c) fail("malloc");
    ssize_t n;
    do n = read(dir->from, c->data, CHUNK);
    while (n < 0 && errno == EINTR);
    c->size = n > 0 ? (size_t)n : 0;
    clock_gettime(CLOCK_MONOTONIC, &c->due);
    add_delay(&c->due);
    if (n > 0 && (size_t)n < CHUNK / 2) {
      struct chunk *smaller = realloc(c, sizeof(struct chunk) + (size_t)n);
      if (smaller) c = smaller;
    }
    push(dir, c);
    if (n <= 0) break; /* EOF or error: the writer passes it on */
  }
  release_connection(dir->conn);
  release_direction(dir);
  return NULL;
}

static int write_all(int fd, const char *data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    data += n;
    size -= (size_t)n;
  }
  return 0;
}

static void *write_side(void *arg) {
  struct direction *dir = arg;
  int broken = 0;
  for (;;) {
    struct chunk *c = pop(dir);
    size_t size = c->size;
    if (size > 0 && !broken) {
      while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &c->due, NULL) == EINTR) {
      }
      if (write_all(dir->to, c->data, size) != 0) {
        /* The destination is gone: end both directions (the reader sees EOF or an error). */
        broken = 1;
        shutdown(dir->from, SHUT_RDWR);
        shutdown(dir->to, SHUT_RDWR);
      }
    }
    free(c);
    if (size == 0) {
      if (!broken) shutdown(dir->to, SHUT_WR);
      break;
    }
  }
  release_connection(dir->conn);
  release_direction(dir);
  return NULL;
}

static void start_thread(void *(*body)(void *), void *arg) {
  pthread_t thread;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  if (pthread_create(&thread, &attr, body, arg) != 0) fail("pthread_create");
  pthread_attr_destroy(&attr);
}

static void start_direction(struct connection *conn, int from, int to) {
  struct direction *dir = calloc(1, sizeof(*dir));
  if (!dir) fail("calloc");
  dir->conn = conn;
  dir->from = from;
  dir->to = to;
  dir->threads_left = 2;
  pthread_mutex_init(&dir->lock, NULL);
  pthread_cond_init(&dir->ready, NULL);
  start_thread(read_side, dir);
  start_thread(write_side, dir);
}

static int read_exactly(int fd, void *buffer, size_t size) {
  char *p = buffer;
  while (size > 0) {
    ssize_t n = read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    p += n;
    size -= (size_t)n;
  }
  return 0;
}

struct listener {
  int fd;
  int dynamic; /* the destination comes in a 6-byte header */
  struct sockaddr_in destination;
};

struct accepted {
  struct listener *listener;
  int client;
};

/* Connects `client` to its destination and starts relaying (its own thread: connecting and
 * reading a header may block). */
static void *open_connection(void *arg) {
  struct accepted *accepted = arg;
  int client = accepted->client;
  struct sockaddr_in destination = accepted->listener->destination;
  int dynamic = accepted->listener->dynamic;
  free(accepted);
  if (dynamic) {
    unsigned char header[6];
    if (read_exactly(client, header, sizeof(header)) != 0) {
      close(client);
      return NULL;
    }
    memset(&destination, 0, sizeof(destination));
    destination.sin_family = AF_INET;
    memcpy(&destination.sin_addr, header, 4);
    memcpy(&destination.sin_port, header + 4, 2);
  }
  int server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (server < 0 || connect(server, (struct sockaddr *)&destination, sizeof(destination)) != 0) {
    if (server >= 0) close(server);
    close(client);
    return NULL;
  }
  no_delay(client);
  no_delay(server);
  struct connection *conn = calloc(1, sizeof(*conn));
  if (!conn) fail("calloc");
  conn->fds[0] = client;
  conn->fds[1] = server;
  conn->threads_left = 4;
  pthread_mutex_init(&conn->lock, NULL);
  start_direction(conn, client, server);
  start_direction(conn, server, client);
  return NULL;
}

static void *accept_loop(void *arg) {
  struct listener *listener = arg;
  for (;;) {
    int client = accept4(listener->fd, NULL, NULL, SOCK_CLOEXEC);
    if (client < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
        if (errno == EMFILE || errno == ENFILE) usleep(10000);
        continue;
      }
      fail("accept");
    }
    struct accepted *accepted = malloc(sizeof(*accepted));
    if (!accepted) fail("malloc");
    accepted->listener = listener;
    accepted->client = client;
    start_thread(open_connection, accepted);
  }
  return NULL;
}

static int parse_port(const char *text) {
  char *end;
  long port = strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || port <= 0 || port > 65535) return -1;
  return (int)port;
}

static struct listener *listen_on(int port, int dynamic, const char *host, int host_port) {
  struct listener *listener = calloc(1, sizeof(*listener));
  if (!listener) fail("calloc");
  listener->dynamic = dynamic;
  if (!dynamic) {
    struct addrinfo hints = {0}, *found = NULL;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, NULL, &hints, &found) != 0 || !found) {
      fprintf(stderr, "delay_relay: cannot resolve %s\n", host);
      exit(2);
    }
    listener->destination = *(struct sockaddr_in *)found->ai_addr;
    listener->destination.sin_port = htons((uint16_t)host_port);
    freeaddrinfo(found);
  }
  listener->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener->fd < 0) fail("socket");
  int one = 1;
  setsockopt(listener->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  struct sockaddr_in address = {0};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons((uint16_t)port);
  if (bind(listener->fd, (struct sockaddr *)&address, sizeof(address)) != 0) fail("bind");
  if (listen(listener->fd, 128) != 0) fail("listen");
  return listener;
}

static void usage(void) {
  fprintf(stderr, "usage: delay_relay --delay-ms D [--dynamic PORT] [LISTEN_PORT:HOST:PORT ...]\n");
  exit(2);
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  /* Chunks come from the heap, not one mmap() each. */
  mallopt(M_MMAP_THRESHOLD, 4 * CHUNK);
  double delay_ms = -1;
  struct listener *listeners[256];
  int count = 0;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--delay-ms") == 0 && i + 1 < argc) {
      char *end;
      delay_ms = strtod(argv[++i], &end);
      if (*end != '\0' || !(delay_ms >= 0)) usage();
    } else if (strcmp(argv[i], "--dynamic") == 0 && i + 1 < argc) {
      int port = parse_port(argv[++i]);
      if (port < 0 || count == 256) usage();
      listeners[count++] = listen_on(port, 1, NULL, 0);
    } else {
      char host[256];
      char listen_text[16], port_text[16];
      const char *first = strchr(argv[i], ':');
      const char *last = strrchr(argv[i], ':');
      if (!first || first == last || (size_t)(first - argv[i]) >= sizeof(listen_text) ||
          (size_t)(last - first - 1) >= sizeof(host) || strlen(last + 1) >= sizeof(port_text) ||
          count == 256)
        usage();
      memcpy(listen_text, argv[i], (size_t)(first - argv[i]));
      listen_text[first - argv[i]] = '\0';
      memcpy(host, first + 1, (size_t)(last - first - 1));
      host[last - first - 1] = '\0';
      strcpy(port_text, last + 1);
      int listen_port = parse_port(listen_text), port = parse_port(port_text);
      if (listen_port < 0 || port < 0) usage();
      listeners[count++] = listen_on(listen_port, 0, host, port);
    }
  }
  if (delay_ms < 0 || count == 0) usage();
  g_delay.tv_sec = (time_t)(delay_ms / 1000.0);
  g_delay.tv_nsec = (long)((delay_ms / 1000.0 - (double)g_delay.tv_sec) * 1e9);
  for (int i = 0; i < count; ++i) start_thread(accept_loop, listeners[i]);
  printf("READY\n");
  fflush(stdout);
  for (;;) pause();
  return 0;
}
