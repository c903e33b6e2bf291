import json, sys
d=sys.argv[1]
for r in (1,2):
    v=json.load(open(f'{d}/vllm{r}.json')); k=json.load(open(f'{d}/kvcm{r}.json'))
    for bs in ('16','32'):
        kb=k['results'][f'block_size_{bs}']; vb=v['results'][f'block_size_{bs}']
        kd=kb['decode']['median']; vd=vb['decode']['median']
        kp=kb['prefill_prefix_reuse']['median']; vp=vb['prefill_prefix_reuse']['median']
        print(r, bs, 'decode %.2f / %.2f (%.2fx)' % (kd['resize_commit_us_per_req_step'], vd['alloc_plus_append_us_per_req_step'], vd['alloc_plus_append_us_per_req_step']/kd['resize_commit_us_per_req_step']),
              '| close dec %.3f / %.3f' % (kd['close_us_per_block'], vd['free_us_per_block']),
              '| close pre %.3f / %.3f' % (kp['close_us_per_block'], vp['free_us_per_block']),
              '| cycle %.1f / %.1f' % (kp['cycle_us_per_request'], vp['cycle_us_per_request']))
    ls=k['results'].get('lookup_scaling') or k['results']['block_size_16'].get('lookup_scaling')
print(json.dumps(k['results'].get('lookup_scaling', {}))[:600])
