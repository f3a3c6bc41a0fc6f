/* Fault pages in ahead of use without changing what they hold: one atomic compare-and-swap
 * of a byte with itself per page. A plain read would map the shared zero page (and the first
 * real write would fault again); a plain write could undo a concurrent writer's store; a CAS
 * that succeeds stores the value it just read, atomically. Page faults take only the mapping's
 * own lock, so unlike madvise(MADV_POPULATE_WRITE) this never holds mmap_lock and never stalls
 * another thread's mmap or munmap. */
#include <stdint.h>

void populate_pages(uint8_t *p, int64_t nbytes, int64_t page) {
    for (int64_t off = 0; off < nbytes; off += page) {
        uint8_t v = __atomic_load_n(p + off, __ATOMIC_RELAXED);
        while (!__atomic_compare_exchange_n(p + off, &v, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        }
    }
}
