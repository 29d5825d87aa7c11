/* Symbols the static CPU libccl.a (PyPI oneccl-cpu-devel) expects from Intel's compiler runtime
 * (libirc's fast memcpy/memset) and from Intel ITT instrumentation (function pointers, null =
 * instrumentation off), which the wheels do not ship. Linked only into oneccl_bench. */
#include <string.h>

void* _intel_fast_memcpy(void* dst, const void* src, size_t n) { return memcpy(dst, src, n); }
void* _intel_fast_memset(void* dst, int c, size_t n) { return memset(dst, c, n); }

void* __itt_domain_create_ptr__3_0 = 0;
void* __itt_event_create_ptr__3_0 = 0;
void* __itt_event_end_ptr__3_0 = 0;
void* __itt_event_start_ptr__3_0 = 0;
void* __itt_metadata_add_ptr__3_0 = 0;
void* __itt_string_handle_create_ptr__3_0 = 0;
void* __itt_task_begin_ptr__3_0 = 0;
void* __itt_task_end_ptr__3_0 = 0;
void* __itt_thread_set_name_ptr__3_0 = 0;
