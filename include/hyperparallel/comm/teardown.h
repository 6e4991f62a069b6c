// What a process must wait for before the Python interpreter finalises.
//
// A Gloo process group runs its collectives on worker threads, and a worker
// drops its references to a finished collective (and to the caller's tensors)
// only after the caller has been woken. If those tensors are Python's, that
// last release takes the GIL; a thread that asks for the GIL once the
// interpreter is finalising is ended with a forced unwind, which crosses
// torch's noexcept frames and aborts the process ("terminate called without an
// active exception") although the program had finished: torch's
// pytorch/pytorch#190489, seen here after a last dist.all_reduce and
// sys.exit(0). hp.comm.shutdown() closes the window by waiting here, at exit,
// with the GIL released, until no Gloo worker is busy.
#pragma once

#include <chrono>

namespace hp::comm {

// Blocks until every Gloo worker thread of this process (torch names them
// "pt_gloo_runloop") has been asleep for several looks in a row: none is
// running, runnable, or about to take the GIL to release a tensor. Returns
// false if that did not happen within `limit` (a collective still in flight).
// Call without the GIL.
bool wait_gloo_workers_idle(std::chrono::milliseconds limit);

}  // namespace hp::comm
