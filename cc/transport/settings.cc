#include "cc/transport/settings.h"

#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tf_rdma {
namespace {

constexpr char kSizeUnits[] = "KMGT";  // 2^10, 2^20, 2^30, 2^40
constexpr char kSizeGrammar[] =
    "a whole number of bytes, or with a binary unit: 64K or 64KiB, 1M or 1MiB, 1G or 1GiB, 1T or 1TiB";

// The power-of-two shift of a size's unit ("", "B", "K", "KB", "KI", "KIB", ..., upper case), or -1.
int UnitShift(std::string_view unit) {
  if (unit.empty() || unit == "B") return 0;
  const size_t prefix = std::string_view(kSizeUnits).find(unit.front());
  if (prefix == std::string_view::npos) return -1;
  unit.remove_prefix(1);
  if (unit.empty() || unit == "B" || unit == "I" || unit == "IB") return 10 * static_cast<int>(prefix + 1);
  return -1;
}

std::string Bound(const Setting& setting, int64_t bound) {
  return setting.kind == SettingKind::kBytes ? FormatSize(static_cast<uint64_t>(bound)) : absl::StrCat(bound);
}

}  // namespace

const Setting* FindSetting(std::string_view name) {
  for (const Setting* setting : settings::kAll) {
    if (name == setting->name) return setting;
  }
  return nullptr;
}

const char* SettingUnit(const Setting& setting) {
  switch (setting.kind) {
    case SettingKind::kMilliseconds: return "ms";
    case SettingKind::kMicroseconds: return "us";
    case SettingKind::kBytes: return "bytes";
    case SettingKind::kText:
    case SettingKind::kCount: break;
  }
  return "";
}

std::string DefaultText(const Setting& setting) {
  if (setting.default_label != nullptr) return setting.default_label;
  return Bound(setting, setting.default_value);
}

absl::Status SettingValueError(const Setting& setting, const std::string& value) {
  const char* value_is = setting.value_is;
  if (value_is == nullptr) {
    switch (setting.kind) {
      case SettingKind::kMilliseconds: value_is = "a whole number of milliseconds"; break;
      case SettingKind::kMicroseconds: value_is = "a whole number of microseconds"; break;
      case SettingKind::kBytes: value_is = "a whole number of bytes"; break;
      case SettingKind::kText:
      case SettingKind::kCount: value_is = "a whole number"; break;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      setting.name, "='", value, "' is not ", value_is, " between ", Bound(setting, setting.minimum),
      " and ", Bound(setting, setting.maximum),
      setting.kind == SettingKind::kBytes ? " (units: K or KiB, M or MiB, G or GiB, T or TiB)" : "",
      "; set it to e.g. ", setting.example != nullptr ? setting.example : DefaultText(setting),
      " or unset it"));
}

absl::StatusOr<int64_t> ParseSettingValue(const Setting& setting, const std::string& value) {
  int64_t number = 0;
  bool parsed = false;
  if (setting.kind == SettingKind::kBytes) {
    const absl::StatusOr<uint64_t> size = ParseSize(value);
    parsed = size.ok() && *size <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (parsed) number = static_cast<int64_t>(*size);
  } else if (setting.kind != SettingKind::kText) {
    parsed = absl::SimpleAtoi(value, &number);
  }
  if (!parsed || number < setting.minimum || number > setting.maximum) {
    return SettingValueError(setting, value);
  }
  return number;
}

absl::StatusOr<uint64_t> ParseSize(std::string_view text) {
  const std::string_view stripped = absl::StripAsciiWhitespace(text);
  const size_t digits = std::min(stripped.find_first_not_of("0123456789"), stripped.size());
  const std::string unit = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(stripped.substr(digits)));
  const int shift = UnitShift(unit);
  uint64_t number = 0;
  if (digits == 0 || shift < 0 || !absl::SimpleAtoi(stripped.substr(0, digits), &number)) {
    return absl::InvalidArgumentError(absl::StrCat("not a size: '", text, "' (", kSizeGrammar, ")"));
  }
  if (number > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("not a size: '", text, "' is more bytes than 64 bits count"));
  }
  return number << shift;
}

std::string FormatSize(uint64_t bytes) {
  for (int i = sizeof(kSizeUnits) - 2; i >= 0; --i) {
    const int shift = 10 * (i + 1);
    if (bytes != 0 && bytes % (uint64_t{1} << shift) == 0) {
      return absl::StrCat(bytes >> shift, " ", std::string(1, kSizeUnits[i]), "iB");
    }
  }
  return absl::StrCat(bytes, " B");
}

}  // namespace tf_rdma
