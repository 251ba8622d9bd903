// Switches tandem's CPU kernels between their own helper threads and OpenMP's (work_queue.h).
#include <torch/library.h>

#include "work_queue.h"

bool use_work_pool(bool on) { return tandem_cpu::WorkPool::enabled().exchange(on); }

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("use_work_pool(bool on) -> bool", &use_work_pool); }
