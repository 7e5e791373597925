// The table of TF_RDMA_* settings holds itself to its own rules, and sizes read in one grammar.
#include "cc/transport/settings.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "cc/transport/transport.h"

namespace tf_rdma {
namespace {

TEST(Settings, EveryRowIsNamedOnceWithADefaultItsOwnParserReadsBack) {
  std::set<std::string> names;
  for (const Setting* setting : settings::kAll) {
    EXPECT_EQ(std::string(setting->name).rfind("TF_RDMA_", 0), 0u) << setting->name;
    EXPECT_TRUE(names.insert(setting->name).second) << setting->name;
    EXPECT_EQ(FindSetting(setting->name), setting);
    if (setting->kind == SettingKind::kText) {
      EXPECT_NE(setting->default_label, nullptr) << setting->name;
      continue;
    }
    EXPECT_LE(setting->minimum, setting->maximum) << setting->name;
    if (setting->default_label == nullptr) {
      const absl::StatusOr<int64_t> read = ParseSettingValue(*setting, DefaultText(*setting));
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_EQ(*read, setting->default_value) << setting->name;
    } else {
      // A label stands for "resolved at run time", a value no one can set.
      EXPECT_FALSE(ParseSettingValue(*setting, std::to_string(setting->default_value)).ok()) << setting->name;
    }
  }
  EXPECT_EQ(FindSetting("TF_RDMA_CONNECT_TIMEOUT"), nullptr);
}

TEST(Settings, TheTransportsDefaultsAreTheTables) {
  const TransportOptions options;
  EXPECT_EQ(options.connect_timeout, absl::Milliseconds(settings::kConnectTimeoutMs.default_value));
  EXPECT_EQ(options.peer_timeout, absl::Milliseconds(settings::kPeerTimeoutMs.default_value));
  EXPECT_EQ(options.limits.max_connections_per_peer_name, 16u);
  EXPECT_EQ(options.limits.shm_max_mapped_bytes_total, uint64_t{1} << 40);
  EXPECT_EQ(options.verbs.poll_window, absl::Microseconds(100));
}

TEST(Settings, AValueOutsideTheBoundsIsAnErrorNamingThemAndAnExample) {
  const absl::StatusOr<int64_t> read = ParseSettingValue(settings::kIoThreads, "65");
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().message(),
            "TF_RDMA_IO_THREADS='65' is not a whole number between 1 and 64; set it to e.g. 2 or unset it");
  EXPECT_EQ(ParseSettingValue(settings::kConnectTimeoutMs, "0").status().message(),
            "TF_RDMA_CONNECT_TIMEOUT_MS='0' is not a whole number of milliseconds between 1 and 86400000; set "
            "it to e.g. 60000 or unset it");
}

TEST(ParseSize, UnitsWithAndWithoutTheIAndTheBReadAlike) {
  for (const char* text : {"1T", "1TiB", "1 tib", "1Ti", "1TB", " 1 T "}) {
    const absl::StatusOr<uint64_t> size = ParseSize(text);
    ASSERT_TRUE(size.ok()) << text << ": " << size.status();
    EXPECT_EQ(*size, uint64_t{1} << 40) << text;
  }
  EXPECT_EQ(*ParseSize("64K"), *ParseSize("64KiB"));
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("4096B"), 4096u);
  for (const char* text : {"", "G", "1.5G", "-1", "1X", "1GiBs", "1 G B", "16777216T"}) {
    EXPECT_FALSE(ParseSize(text).ok()) << text;
  }
}

TEST(FormatSize, TheLargestUnitThatDividesElseBytes) {
  EXPECT_EQ(FormatSize(0), "0 B");
  EXPECT_EQ(FormatSize(1536), "1536 B");
  EXPECT_EQ(FormatSize(uint64_t{64} << 30), "64 GiB");
  EXPECT_EQ(FormatSize(uint64_t{1} << 40), "1 TiB");
  EXPECT_EQ(*ParseSize(FormatSize(uint64_t{3} << 20)), uint64_t{3} << 20);
}

}  // namespace
}  // namespace tf_rdma
