// Peers start in any order: a connect to a peer that is not listening yet is tried again, with
// backoff, until the connect timeout ends. One policy for every backend.
#ifndef TF_RDMA_CC_TRANSPORT_CONNECT_RETRY_H_
#define TF_RDMA_CC_TRANSPORT_CONNECT_RETRY_H_

#include <algorithm>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cc/transport/handshake.h"
#include "cc/transport/transport.h"

namespace tf_rdma {

// The pause between attempts to reach a peer: 10 ms, doubling up to 500 ms, never past the
// deadline. A peer that fails every attempt at once is tried a few times a second, not thousands.
class ConnectBackoff {
 public:
  explicit ConnectBackoff(absl::Time deadline) : deadline_(deadline) {}
  // Sleeps before the next attempt; false (without sleeping) once the deadline has passed.
  bool Wait() {
    const absl::Duration left = deadline_ - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    absl::SleepFor(std::min(pause_, left));
    pause_ = std::min(pause_ * 2, absl::Milliseconds(500));
    return true;
  }

 private:
  const absl::Time deadline_;
  absl::Duration pause_ = absl::Milliseconds(10);
};

// What one attempt gave: the connection, or why not and whether another attempt may succeed.
struct ConnectAttempt {
  absl::StatusOr<std::shared_ptr<Connection>> connection;
  bool retry = false;
};

// Attempts (each told the overall deadline) until one connects or fails for good; the last one is
// at the deadline, since giving up a backoff early would cut the timeout short.
inline absl::StatusOr<std::shared_ptr<Connection>> ConnectWithRetries(
    Backend backend, const Endpoint& endpoint, absl::Duration timeout,
    const std::function<ConnectAttempt(absl::Time deadline)>& attempt) {
  const absl::Time deadline = absl::Now() + timeout;
  ConnectBackoff backoff(deadline);
  // The listener's last "not now": the reason the dial kept trying, which names the true cause
  // even when the last attempt ran out of time half way (rdma_cm under load) rather than being
  // refused again.
  absl::Status refused;
  while (true) {
    ConnectAttempt tried = attempt(deadline);
    if (tried.connection.ok() || !tried.retry) return std::move(tried.connection);
    if (RefusedForNow(tried.connection.status())) refused = tried.connection.status();
    if (!backoff.Wait()) {
      const absl::Status& why = refused.ok() ? tried.connection.status() : refused;
      return absl::UnavailableError(absl::StrCat(
          "could not reach the tf_rdma ", BackendName(backend), " listener of peer ", endpoint.ToString(),
          " within ", absl::FormatDuration(timeout), " (TF_RDMA_CONNECT_TIMEOUT_MS): ", why.message(),
          refused.ok() ? ". Is the peer running, with tf_rdma loaded?" : ""));
    }
  }
}

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TRANSPORT_CONNECT_RETRY_H_
