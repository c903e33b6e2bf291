import sys,json,glob
for f in sys.argv[1:]:
    d=json.load(open(f))['results']['lookup_scaling']
    p=json.load(open(f))['results']['block_size_16']['prefill_prefix_reuse']['median']
    row=[f.split('-')[-1][:-5]]
    for k in ('10000','100000','1000000'):
        e=d[k]; bare=e.get('bare_us_per_matched_block_median', e.get('bare_chain_us_per_matched_block_median'))
        row.append('%s: list %.3f int32 %.3f bare %.3f'%(k, e['us_per_matched_block_median'], e['int32_array_us_per_matched_block_median'], bare))
    row.append('flat %.2f'%d['ratio_largest_to_smallest_median'])
    row.append('prefill lookup/blk %.3f commit/newblk %.3f'%(p['lookup_us_per_matched_block'], p['commit_us_per_new_block']))
    print(' | '.join(row))
