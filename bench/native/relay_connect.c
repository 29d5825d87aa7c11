/* Benchmark-only LD_PRELOAD library: sends a task's direct TCP connections through the emulated
 * network's delaying relay (bench/netem.py, bench/delay_relay.py --dynamic).
 *
 * TensorFlow tasks advertise relay addresses, so their gRPC traffic is delayed without help.
 * Horovod's Gloo ranks instead publish their own listening addresses and connect to each other
 * directly, which would skip the delay. With NESTPIPE_RELAY_SUBNET (an IPv4 prefix such as
 * "10.211.0.") and NESTPIPE_RELAY_ADDRESS / NESTPIPE_RELAY_PORT (the relay's dynamic port) set, a
 * connect() to an address in that subnet (other than the relay's own and those listed in
 * NESTPIPE_RELAY_EXCLUDE) is made to the relay instead, followed by a 6-byte header: the original
 * IPv4 address and port in network byte order. The relay connects onward and delays both
 * directions. A non-blocking socket is connected blocking and returned connected (connect() then
 * returns 0, which non-blocking callers accept). Every other connect() is passed through.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

/* The IPv4 destination of `addr` (AF_INET, or AF_INET6 holding an IPv4-mapped address). */
static int ipv4_destination(const struct sockaddr *addr, socklen_t len, struct in_addr *ip,
                            in_port_t *port) {
  if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
    *ip = in->sin_addr;
    *port = in->sin_port;
    return 1;
  }
  if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      memcpy(ip, &in6->sin6_addr.s6_addr[12], 4);
      *port = in6->sin6_port;
      return 1;
    }
  }
  return 0;
}

/* Whether `ip` (dotted) is listed in the comma-separated `list`. */
static int listed(const char *list, const char *ip) {
  size_t n = strlen(ip);
  for (const char *p = list; p && *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len == n && strncmp(p, ip, n) == 0) return 1;
    p = end ? end + 1 : NULL;
  }
  return 0;
}

static int write_all(int fd, const unsigned char *data, size_t len) {
  while (len > 0) {
    ssize_t n = write(fd, data, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    data += n;
    len -= (size_t)n;
  }
  return 0;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
  static connect_fn real_connect = NULL;
  if (real_connect == NULL) real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
  const char *subnet = getenv("NESTPIPE_RELAY_SUBNET");
  const char *relay = getenv("NESTPIPE_RELAY_ADDRESS");
  const char *relay_port = getenv("NESTPIPE_RELAY_PORT");
  struct in_addr ip;
  in_port_t port;
  if (subnet == NULL || relay == NULL || relay_port == NULL || addr == NULL ||
      !ipv4_destination(addr, len, &ip, &port))
    return real_connect(fd, addr, len);
  char dotted[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &ip, dotted, sizeof(dotted));
  if (strncmp(dotted, subnet, strlen(subnet)) != 0 || strcmp(dotted, relay) == 0 ||
      listed(getenv("NESTPIPE_RELAY_EXCLUDE"), dotted))
    return real_connect(fd, addr, len);

  /* To the relay, in the caller's address family. */
  struct sockaddr_storage to;
  socklen_t to_len = len;
  memcpy(&to, addr, len);
  if (addr->sa_family == AF_INET) {
    struct sockaddr_in *in = (struct sockaddr_in *)&to;
    inet_pton(AF_INET, relay, &in->sin_addr);
    in->sin_port = htons((in_port_t)atoi(relay_port));
  } else {
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&to;
    inet_pton(AF_INET, relay, &in6->sin6_addr.s6_addr[12]);
    in6->sin6_port = htons((in_port_t)atoi(relay_port));
  }
  int flags = fcntl(fd, F_GETFL);
  if (flags >= 0 && (flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  int rc;
  do {
    rc = real_connect(fd, (const struct sockaddr *)&to, to_len);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) {
    unsigned char header[6];
    memcpy(header, &ip, 4);
    memcpy(header + 4, &port, 2);
    rc = write_all(fd, header, sizeof(header));
  }
  int saved = errno;
  if (flags >= 0 && (flags & O_NONBLOCK)) fcntl(fd, F_SETFL, flags);
  errno = saved;
  return rc;
}
