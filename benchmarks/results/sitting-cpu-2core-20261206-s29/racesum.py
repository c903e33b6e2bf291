import json, sys
d=sys.argv[1]
for r in (1,2):
    v=json.load(open(f'{d}/vllm{r}.json')); k=json.load(open(f'{d}/kvcm{r}.json'))['results']
    print(r, 'vllm %.1f us/req hit %.5f | kvcm %.1f us/req hit %.5f | kvcm faster %.2fx | hit rel diff %.4f' % (v['us_per_request_median'], v['hit_rate'], k['us_per_request_median'], k['hit_rate'], v['us_per_request_median']/k['us_per_request_median'], abs(k['hit_rate']-v['hit_rate'])/v['hit_rate']))
