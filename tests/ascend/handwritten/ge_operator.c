/* ge::OperatorFactory::CreateOperator returns a ge::Operator BY VALUE (hidden sret pointer in rdi).
   ge::Operator = { vptr; std::shared_ptr<OperatorImpl> operator_impl_; } (24 bytes); MindSpore copies the
   shared_ptr out of it (AclConverter), so the object must be constructed: empty impl, vptr -> a table of
   return-0 stand-ins (the virtual destructor becomes a no-op). */
#include <string.h>
extern char standin_vtable_cxx[];
void *standin_CreateOperator_cc(void *ret, const char *name, const char *type)
    __asm__("_ZN2ge15OperatorFactory14CreateOperatorEPKcS2_");
void *standin_CreateOperator_ss(void *ret, const void *name, const void *type)
    __asm__("_ZN2ge15OperatorFactory14CreateOperatorERKSsS2_");
static void *make_empty_operator(void *ret) {
  memset(ret, 0, 24);
  *(void **)ret = standin_vtable_cxx + 16;
  return ret;
}
void *standin_CreateOperator_cc(void *ret, const char *name, const char *type) { return make_empty_operator(ret); }
void *standin_CreateOperator_ss(void *ret, const void *name, const void *type) { return make_empty_operator(ret); }
