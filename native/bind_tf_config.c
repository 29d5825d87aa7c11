/* LD_PRELOAD library: makes a TensorFlow task's gRPC server listen only on its TF_CONFIG address.
 *
 * TensorFlow's gRPC server binds its port on every interface (0.0.0.0 / [::]); the address in
 * TF_CONFIG only chooses the port. Preloaded into a task started by `python -m tf_nestpipe.launch`
 * (or `python -m tf_nestpipe.launch.task`), this replaces such a wildcard bind() of the task's
 * port by a bind to the host in TF_CONFIG, given here by TF_NESTPIPE_BIND_PORT and TF_NESTPIPE_BIND_HOST
 * (a numeric IPv4 or IPv6 address). Every other bind() is passed through unchanged. When that
 * host is not an address of this machine (a relay, NAT, or a Kubernetes service address), the
 * narrowed bind fails with EADDRNOTAVAIL: the server then binds as TensorFlow asked (every
 * interface) and a warning says so on stderr, rather than the task failing to start.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

/* The narrowed bind, or the original one (with a warning) if the host is not local. */
static int bind_narrowed(bind_fn real_bind, int fd, const struct sockaddr *narrowed,
                         socklen_t narrowed_len, const struct sockaddr *addr, socklen_t len,
                         const char *host, int port) {
  int rc = real_bind(fd, narrowed, narrowed_len);
  if (rc != 0 && errno == EADDRNOTAVAIL) {
    fprintf(stderr, "tf_nestpipe: TF_CONFIG host %s is not an address of this machine (relay, "
            "NAT or service address?); the server on port %d listens on every interface\n",
            host, port);
    return real_bind(fd, addr, len);
  }
  return rc;
}

static int wanted_port(void) {
  const char *port = getenv("TF_NESTPIPE_BIND_PORT");
  return port ? atoi(port) : -1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real_bind = NULL;
  if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  const char *host = getenv("TF_NESTPIPE_BIND_HOST");
  int port = wanted_port();
  if (host == NULL || port <= 0 || addr == NULL) return real_bind(fd, addr, len);

  struct in_addr v4;
  struct in6_addr v6;
  int host_is_v4 = inet_pton(AF_INET, host, &v4) == 1;
  int host_is_v6 = !host_is_v4 && inet_pton(AF_INET6, host, &v6) == 1;
  if (!host_is_v4 && !host_is_v6) return real_bind(fd, addr, len);

  if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
    if (ntohs(in->sin_port) == port && in->sin_addr.s_addr == htonl(INADDR_ANY)) {
      if (!host_is_v4) { errno = EADDRNOTAVAIL; return -1; }
      struct sockaddr_in narrowed = *in;
      narrowed.sin_addr = v4;
      return bind_narrowed(real_bind, fd, (const struct sockaddr *)&narrowed, sizeof(narrowed),
                           addr, len, host, port);
    }
  } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
    if (ntohs(in6->sin6_port) == port && memcmp(&in6->sin6_addr, &in6addr_any, sizeof(v6)) == 0) {
      struct sockaddr_in6 narrowed = *in6;
      if (host_is_v6) {
        narrowed.sin6_addr = v6;
      } else { /* an IPv4 host on a dual-stack socket: its IPv4-mapped address */
        memset(&narrowed.sin6_addr, 0, sizeof(narrowed.sin6_addr));
        narrowed.sin6_addr.s6_addr[10] = 0xff;
        narrowed.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&narrowed.sin6_addr.s6_addr[12], &v4, 4);
      }
      return bind_narrowed(real_bind, fd, (const struct sockaddr *)&narrowed, sizeof(narrowed),
                           addr, len, host, port);
    }
  }
  return real_bind(fd, addr, len);
}
