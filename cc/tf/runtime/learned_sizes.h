// What each transfer (named without its step) carried last time, so a steady shape needs one grant.
#ifndef TF_RDMA_CC_TF_RUNTIME_LEARNED_SIZES_H_
#define TF_RDMA_CC_TF_RUNTIME_LEARNED_SIZES_H_

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace tf_rdma {

// Bounded: a program with unbounded distinct transfers forgets old ones.
class LearnedSizes {
 public:
  // 0 when unknown.
  uint64_t Expected(const std::string& transfer) const;
  void Learn(const std::string& transfer, uint64_t bytes);

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, uint64_t> bytes_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_CC_TF_RUNTIME_LEARNED_SIZES_H_
