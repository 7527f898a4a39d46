// ge::StatusFactory: its RegisterErrorNo is inlined into MindSpore's static initialisers
// (GE_ERRORNO macros), which touch the std::map member directly -> needs a real object.
#include <map>
#include <string>
#include <cstdint>
namespace ge {
class StatusFactory {
 public:
  static StatusFactory *Instance();
  void RegisterErrorNo(uint32_t err, const std::string &desc);
  void RegisterErrorNo(uint32_t err, const char *desc);
  std::string GetErrDesc(uint32_t err);
  std::map<uint32_t, std::string> err_desc_;
};
StatusFactory *StatusFactory::Instance() {
  static StatusFactory *inst = new StatusFactory();
  return inst;
}
void StatusFactory::RegisterErrorNo(uint32_t err, const std::string &desc) {
  if (err_desc_.find(err) == err_desc_.end()) err_desc_[err] = desc;
}
void StatusFactory::RegisterErrorNo(uint32_t err, const char *desc) {
  if (desc != nullptr) RegisterErrorNo(err, std::string(desc));
}
std::string StatusFactory::GetErrDesc(uint32_t err) {
  auto it = err_desc_.find(err);
  return it == err_desc_.end() ? std::string() : it->second;
}
}  // namespace ge
