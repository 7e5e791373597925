// TensorFlow's pluggable tf.data service data transfer protocol
// (tensorflow/core/data/service/data_transfer.h), declared here because the pip wheel ships neither
// that header nor the GetElementRequest proto's (tensorflow/core/data/service/worker.pb.h).
//
// Checked against TensorFlow 2.21's libtensorflow_cc.so.2, not guessed:
// - DataTransferServer::Register/Build and DataTransferClient::Register/Build are exported with
//   exactly these signatures (nm -D --defined-only | c++filt).
// - DataTransferClient's vtable (exported, as are GrpcDataTransferClient's): destructors,
//   GetElement, TryCancel, GetCompatibilityInfo, CheckCompatibility.
// - DataTransferServer's virtuals, from the calls WorkerGrpcDataServer::
//   MaybeStartAlternativeDataTransferServer makes through its vtable: Start(WorkerConfig) at 0x10,
//   Port() at 0x18, GetCompatibilityInfo at 0x20, FallBackToGrpcAtClientCreationTime at 0x28,
//   FallBackToGrpcAtGetElementTime at 0x30.
// - Config is 0x40 bytes (GrpcTransferClientRegistrar's factory thunk moves a string_view at 0,
//   a std::string at 0x10 and two pointers at 0x30).
// tests/tf/test_data_service.py runs the protocol end to end against the installed TensorFlow;
// setup.py builds against that exact TensorFlow. Re-check all of the above per TensorFlow release.
#ifndef TF_RDMA_CC_TF_DATA_DATA_TRANSFER_API_H_
#define TF_RDMA_CC_TF_DATA_DATA_TRANSFER_API_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/protobuf/service_config.pb.h"

namespace tensorflow {
namespace data {

// A protobuf message (tensorflow.data.GetElementRequest) whose generated class is not shipped:
// handled through google::protobuf::Message (its only base), see element_message.h.
class GetElementRequest;

struct GetElementResult {
  GetElementResult() = default;
  GetElementResult(const GetElementResult&) = delete;
  GetElementResult& operator=(const GetElementResult&) = delete;
  GetElementResult(GetElementResult&&) = default;
  GetElementResult& operator=(GetElementResult&&) = default;

  GetElementResult Copy() const;
  size_t EstimatedMemoryUsageBytes() const;

  std::vector<Tensor> components;
  int64_t element_index = 0;
  bool end_of_sequence = false;
  bool skip = false;
};

class DataTransferClient {
 public:
  struct Config {
    absl::string_view protocol;
    std::string address;
    const DeviceBase::AcceleratorDeviceInfo* accelerator_device_info = nullptr;
    Allocator* allocator = nullptr;
  };
  using ClientFactoryT = std::function<absl::Status(Config, std::unique_ptr<DataTransferClient>*)>;
  virtual ~DataTransferClient() = default;
  virtual absl::Status GetElement(const GetElementRequest& req, GetElementResult& result) = 0;
  virtual void TryCancel() = 0;
  static void Register(std::string name, ClientFactoryT factory);
  static absl::Status Build(std::string name, Config config, std::unique_ptr<DataTransferClient>* out);
  virtual absl::StatusOr<std::string> GetCompatibilityInfo() const { return std::string(); }
  virtual absl::Status CheckCompatibility(const std::string& server_compatibility_info) const {
    return absl::OkStatus();
  }
};

class DataTransferServer {
 public:
  using GetElementT = std::function<absl::Status(const GetElementRequest*, GetElementResult*)>;
  using ServerFactoryT = std::function<absl::Status(GetElementT, std::shared_ptr<DataTransferServer>*)>;
  virtual ~DataTransferServer() = default;
  virtual absl::Status Start(const experimental::WorkerConfig& config) = 0;
  virtual int Port() const = 0;
  static void Register(std::string name, ServerFactoryT factory);
  static absl::Status Build(std::string name, GetElementT get_element, std::shared_ptr<DataTransferServer>* out);
  virtual absl::StatusOr<std::string> GetCompatibilityInfo() const { return std::string(); }
  virtual bool FallBackToGrpcAtClientCreationTime() const { return true; }
  virtual bool FallBackToGrpcAtGetElementTime() const { return true; }
};

}  // namespace data
}  // namespace tensorflow

#endif  // TF_RDMA_CC_TF_DATA_DATA_TRANSFER_API_H_
